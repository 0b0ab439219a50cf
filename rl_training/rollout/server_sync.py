"""Publishing the trainer's weights to vLLM servers (rollout.backend=server), rank 0 only. vLLM 0.32.

- lora (default): the adapter is written to a new directory (temp dir, fsync, rename, as checkpoints are)
  and loaded into every server under a new name `policy-v{n}` via /v1/load_lora_adapter, never in place:
  after a `load_inplace` load, 0.32 re-reads the adapter files on every request (vLLM issue 41482), and its
  prefix cache keys LoRA blocks by (name, path), so a name reloaded from the same path would serve KV
  blocks computed with the old weights. A new name and a new path each time avoid both. Versions older than
  server.keep_versions are unloaded (/v1/unload_lora_adapter) and their directories deleted. A name left
  loaded by an earlier process (a resumed run against a live server) is unloaded first and loaded again from
  this process's own, new path.
- full: the merged weights (LoRA delta folded in) as safetensors, then `/collective_rpc reload_weights
  weights_path=DIR` and `/reset_prefix_cache` (server started with VLLM_SERVER_DEV_MODE=1). For adapters the
  server cannot take (rank, target modules). The served name stays the base model's.
- Weight-version tags (issue 41, item 3), full and nccl: once a server holds version n's weights it is tagged
  with n (`/update_weight_version`, a route of VLLM_SERVER_DEV_MODE=1 servers, which both need anyway), and the
  backend reads every server's tag (`/weight_info`) for the completions it sampled (`served_versions`). Under
  lora each version is its own name, which is the tag: a request for policy-v{n} is sampled by version n or
  refused.
- nccl (CUDA only): vLLM's own NCCL weight transfer (`NCCLTrainerWeightTransferEngine` over the server's
  /init_weight_transfer_engine, /update_weights routes; server started with
  `--weight-transfer-config '{"backend": "nccl"}'`). It fails at init on CPU ("Cannot access accelerator").
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rl_training.base import faults
from rl_training.ckpt.marker import fsync_tree
from rl_training.rollout.server_client import ServerClient, ServerError


def served_name(cfg, version: int, base: str = "") -> str:
    """The `model` a request names to sample policy `version`; `base`: the server's base model name."""
    if cfg.server.weight_sync == "lora":
        return f"policy-v{version}"
    return base or cfg.server.served_model


def write_atomic(final: Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` into a hidden sibling directory, fsync it, rename it to `final`: a server never reads a
    half-written version."""
    tmp = final.parent / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final.resolve()


def tag_version(client: ServerClient, url: str, version: int) -> None:
    """Tag the server at `url` with the policy version its weights now are (vLLM 0.32's engine weight version)."""
    client.request("POST", "/update_weight_version", {"new_version": str(version)}, url=url)


def served_versions(client: ServerClient) -> dict[str, int]:
    """Every server's weight-version tag, by URL (`tag_version`); a server never tagged by this run says so."""

    def read(url: str) -> int:
        tag = client.request("GET", "/weight_info", url=url)["weight_version"]
        if not str(tag).isdigit():
            raise ServerError(
                f"{url} is tagged with weight version {tag!r}, not a policy version: the publish never tagged it "
                "(a server restarted since, or one this run did not publish to)"
            )
        return int(tag)

    return dict(zip(client.urls, [f.result() for f in [client.pool.submit(read, u) for u in client.urls]], strict=True))


def _on_every_server(client: ServerClient, fn: Callable[[str], None]) -> None:
    """fn(url) for every server, in parallel; the first failure is raised."""
    for fut in [client.pool.submit(fn, url) for url in client.urls]:
        fut.result()


class LoraPublisher:
    def __init__(self, cfg, client: ServerClient, root: Path):
        self.cfg, self.client, self.root = cfg, client, root
        self.session = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"  # new paths for every process
        self.loaded: list[tuple[int, Path]] = []  # (version, directory) loaded on every server, oldest first

    def publish(self, model, version: int) -> None:
        if faults.injected("server.stale_publish") and self.loaded:  # the new name serves the previous weights
            previous = self.loaded[-1][1]
            self._publish(version, lambda tmp: shutil.copytree(previous, tmp, dirs_exist_ok=True))
            return
        self._publish(version, model.save_pretrained)

    def republish(self, adapter_dir: Path, version: int) -> None:
        """A saved adapter directory (a checkpoint's past version) as policy-v{version}, from a new path."""
        self._publish(version, lambda tmp: shutil.copytree(adapter_dir, tmp, dirs_exist_ok=True))

    def dirs(self, versions) -> dict[int, Path]:
        have = dict(self.loaded)
        missing = [v for v in versions if v not in have]
        if missing:
            raise ServerError(f"published policy versions {missing} are no longer kept (loaded: {sorted(have)})")
        return {v: have[v] for v in versions}

    def _publish(self, version: int, write: Callable[[Path], None]) -> None:
        from rl_training.rollout.async_queue import versions_to_keep

        name = served_name(self.cfg, version)
        path = write_atomic(self.root / f"{name}-{self.session}", write)
        _on_every_server(self.client, lambda url: self._load(url, name, path))
        self.loaded = sorted([*self.loaded, (version, path)])
        # Async rollouts (K > 0) sample versions up to K older than the newest: never unload one of those
        while len(self.loaded) > versions_to_keep(self.cfg.server.keep_versions, self.cfg.rollout.max_async_level):
            old, old_path = self.loaded.pop(0)
            _on_every_server(self.client, lambda url, o=old: self._unload(url, served_name(self.cfg, o)))
            shutil.rmtree(old_path, ignore_errors=True)

    def _load(self, url: str, name: str, path: Path) -> None:
        body = {"lora_name": name, "lora_path": str(path)}
        try:
            # a refused adapter is a 500 that retries cannot fix: fail fast
            self.client.request("POST", "/v1/load_lora_adapter", body, url=url, retry_5xx=False)
        except ServerError as e:
            if e.status == 400 and "already been loaded" in str(e):  # left by an earlier process
                self._unload(url, name)
                self.client.request("POST", "/v1/load_lora_adapter", body, url=url, retry_5xx=False)
                return
            lora = self.cfg.lora
            hint = (
                "the server has no runtime LoRA loading: start it with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
                if e.status == 404 and "No adapter found" not in str(e)
                else f"server.adapter_dir ({self.root}) must be on a filesystem the server reads"
                if "No adapter found" in str(e)
                else f"start the server with --enable-lora --max-lora-rank >= {lora.r} (docs/server.md), or set "
                "server.weight_sync=full"
            )
            raise ServerError(
                f"{url} refused the policy adapter (lora.r={lora.r}, lora.target_modules={lora.target_modules}): "
                f"{e}; {hint}",
                e.status,
            ) from None

    def _unload(self, url: str, name: str) -> None:
        try:
            self.client.request("POST", "/v1/unload_lora_adapter", {"lora_name": name}, url=url)
        except ServerError as e:
            if e.status != 404:  # 404: not loaded there (a server restarted since): nothing to unload
                raise

    def close(self) -> None:
        """Unload this process's versions (a finished run leaves the servers' adapter slots free)."""
        for version, _ in self.loaded:
            for url in self.client.urls:
                try:
                    self._unload(url, served_name(self.cfg, version))
                except ServerError as e:
                    print(f"note: could not unload {served_name(self.cfg, version)} from {url}: {e}", flush=True)
        self.loaded = []


class FullWeightPublisher:
    def __init__(self, cfg, client: ServerClient, root: Path):
        self.cfg, self.client, self.root = cfg, client, root
        self.session = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.written: list[Path] = []

    def publish(self, model, version: int) -> None:
        from safetensors.torch import save_file

        from rl_training.policy.models import merged_hf_weights

        def write(tmp: Path) -> None:
            tensors = {k: v.detach().to("cpu").contiguous() for k, v in merged_hf_weights(model)}
            save_file(tensors, str(tmp / "model.safetensors"))

        path = write_atomic(self.root / f"full-v{version}-{self.session}", write)

        def reload(url: str) -> None:
            if faults.injected("server.stale_reload") and self.written:  # the server keeps the previous weights
                return
            try:
                body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
                self.client.request("POST", "/collective_rpc", body, url=url, retry_5xx=False)
            except ServerError as e:
                hint = "start the server with VLLM_SERVER_DEV_MODE=1" if e.status == 404 else "see the server log"
                raise ServerError(f"{url} could not reload full weights from {path}: {e}; {hint}", e.status) from None
            # KV blocks cached before the reload came from the old weights
            self.client.request("POST", "/reset_prefix_cache", url=url)
            tag_version(self.client, url, version)

        _on_every_server(self.client, reload)
        self.written.append(path)
        while len(self.written) > self.cfg.server.keep_versions:
            shutil.rmtree(self.written.pop(0), ignore_errors=True)

    def close(self) -> None:
        pass


class NcclPublisher:
    """vLLM 0.32's trainer-side NCCL engine, one transfer group per server (rank 0 of the group is this
    process, the server's workers follow). CUDA only; covered by a gpu-marked test."""

    def __init__(self, cfg, client: ServerClient, host: str):
        self.cfg, self.client, self.host = cfg, client, host
        self.engines: list = []

    def _init(self, model) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        source = merged_weight_source(model)
        for i, url in enumerate(self.client.urls):
            workers = self.client.request("GET", "/get_world_size", url=url)["world_size"]
            info = NCCLTrainerInitInfo(
                master_address=self.host, master_port=self.cfg.server.nccl_port + i, world_size=1 + workers, rank=0
            )
            sync = HTTPVLLMWeightSyncClient(url, timeout=self.cfg.server.timeout_s)
            self.engines.append(WeightTransferTrainerFactory.trainer_init(info, client=sync, source=source))

    def publish(self, model, version: int) -> None:
        if not self.engines:
            self._init(model)
        for engine, url in zip(self.engines, self.client.urls, strict=True):
            engine.send_weights()
            self.client.request("POST", "/reset_prefix_cache", url=url)
            tag_version(self.client, url, version)

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()


def ordered_on_side_streams(pairs):
    """(name, tensor) pairs for vLLM's NCCL producer (weight_transfer/packed_tensor.py), which pulls them inside its
    side streams, in turn: a chunk of pairs on one, the next chunk on the other. Each pull is ordered after
    - the default stream, where the optimizer wrote the parameters the merge reads (issue 29, N5), and
    - the previous pull's stream: `merged_hf_weights` computes the batched LoRA merge (lora_merge.py) at its first
      pull, on the stream current then, and yields views of it later, possibly on the other stream; without an
      event between them the broadcast could read a merge still being computed (issue 41, item 1: q/v-only
      targets on a model whose merged set fits one batch).
    Each tensor is also recorded on the stream that reads it, so the caching allocator does not hand its memory
    to the producing stream while the other still reads it. A no-op on CPU."""
    it = iter(pairs)
    produced = None  # an event after the previous pull, on the stream it ran on
    while True:
        cuda = torch.cuda.is_available()
        if cuda:
            stream = torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.default_stream())
            if produced is not None:
                stream.wait_event(produced)
        try:
            name, tensor = next(it)
        except StopIteration:
            return
        if cuda:
            produced = stream.record_event()
            if tensor.is_cuda:
                tensor.record_stream(stream)
        yield name, tensor


def merged_weight_source(model):
    """A vLLM WeightSource over the policy's merged HF weights (`merged_hf_weights`), re-iterable. The class
    is built here because vLLM is imported only on the nccl path."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from rl_training.policy.models import merged_hf_weights

    class _Merged(WeightSource):
        def __init__(self):
            self._meta = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in merged_hf_weights(model)]

        def metadata(self):
            return self._meta

        def __iter__(self):
            return ordered_on_side_streams(merged_hf_weights(model))

    return _Merged()


def make_publisher(cfg, client: ServerClient, run_dir: Path, dist_info):
    """The publisher of server.weight_sync; rank 0 only (the others never touch the servers' weights)."""
    root = Path(cfg.server.adapter_dir or Path(run_dir) / "published").expanduser().resolve()
    if cfg.server.weight_sync == "lora":
        return LoraPublisher(cfg, client, root)
    if cfg.server.weight_sync == "full":
        return FullWeightPublisher(cfg, client, root)
    import socket

    return NcclPublisher(cfg, client, os.environ.get("MASTER_ADDR") or socket.gethostname())
