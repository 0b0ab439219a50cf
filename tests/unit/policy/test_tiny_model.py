"""make_tiny_model writes the model beside its destination and renames it into place: a process that sees the
directory sees a whole model (two demos may create it at once: scripts/run_tests.sh demos), and writing it again
over an existing one gives the same bytes and leaves nothing behind."""

from __future__ import annotations

import threading

from rl_training.policy.tiny_model import make_tiny_model

WHOLE = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_the_directory_appears_whole(tmp_path):
    out = tmp_path / "models" / "tiny"
    seen: list[set[str]] = []  # the file names each time the directory was there
    writer = threading.Thread(target=make_tiny_model, args=(out,))
    writer.start()
    while writer.is_alive():
        if out.exists():
            seen.append({p.name for p in out.iterdir()})
    writer.join()
    seen.append({p.name for p in out.iterdir()})
    assert all(WHOLE <= names for names in seen), [sorted(n) for n in seen if not WHOLE <= n][:1]
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]  # no temporary directory left
    assert oct(out.stat().st_mode & 0o777) == "0o755"


def test_writing_again_gives_the_same_bytes(tmp_path):
    out = make_tiny_model(tmp_path / "tiny", seed=3)
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    make_tiny_model(out, seed=3)  # over the existing files
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]
