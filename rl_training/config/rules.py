"""The rule book a loaded config must satisfy beyond each field's type and bounds: values each valid alone but wrong
together, or wrong for training (rl_training/config/load.py applies them at load; one line naming both keys)."""

from __future__ import annotations

import re
from pathlib import Path

from rl_training.algs.corrections import CORRECTIONS
from rl_training.algs.objectives import OBJECTIVES
from rl_training.config.plugins import BACKEND_NAMES, check_builtin
from rl_training.config.schema import Config, ConfigError

MAIN_EVAL_METRIC = "eval/accuracy"  # ckpt.keep_best=auto: the in-loop eval's main metric
_REMOTE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_UNSAFE_PATH_CHARS = set('"$`\\:,\n\r')  # rclone-python builds a shell command line in double quotes


def parse_keep_best(value: str, eval_every: int) -> tuple[str, str]:
    """(metric, 'max' | 'min') from ckpt.keep_best; ('', '') when off. One-line ConfigError when malformed."""
    if value == "none" or (value == "auto" and not eval_every):
        return "", ""
    if value == "auto":
        return MAIN_EVAL_METRIC, "max"
    metric, _, mode = value.partition(":")
    mode = mode or "max"
    if not metric or "/" not in metric or mode not in ("max", "min"):
        raise ConfigError(
            f"ckpt.keep_best={value!r}: expected auto, none or <metric>[:max|:min] with a logged metric such as "
            "eval/accuracy or rollout/reward_mean:max"
        )
    if metric.startswith("eval/") and not eval_every:
        raise ConfigError(f"ckpt.keep_best={value!r} needs the in-loop eval: set eval.every > 0 (and data.eval)")
    return metric, mode


def check_run_name(name: str, where: str = "") -> None:
    """run.name is one directory under run.output_dir (and one prefix in the sync bucket): a single path
    component, so `../../x` or `/x` cannot write outside the output directory."""
    bad = (
        "is empty"
        if not name.strip()
        else "is '.' or '..'"
        if name in (".", "..")
        else "has a path separator"
        if "/" in name or "\\" in name
        else "has a NUL or control character"
        if any(ord(c) < 32 for c in name)
        else ""
    )
    if bad:
        raise ConfigError(f"{where}run.name={name!r} {bad}; it must be a single path component (a directory name)")


def check_plugin_names(cfg: Config, where: str = "") -> None:
    """A built-in name an extension point does not have is one line at load (a user's 'file.py:NAME' is
    imported and checked where it is built, before any model loads: config/plugins.py)."""
    names = {
        "rollout.backend": ("backend", cfg.rollout.backend, ["auto", *BACKEND_NAMES]),
        "loss.type": ("objective", cfg.loss.type, list(OBJECTIVES)),
        "loss.correction": ("correction", cfg.loss.correction, ["none", *CORRECTIONS]),
    }
    for key, (noun, spec, builtin) in names.items():
        try:
            check_builtin(key, noun, spec, builtin)
        except ConfigError as e:
            raise ConfigError(f"{where}{e}") from None


def check_combinations(cfg: Config, where: str = "", training: bool = True) -> None:
    """Values each valid alone but wrong together (or wrong for training): one line naming both keys."""
    check_run_name(cfg.run.name, where)
    check_plugin_names(cfg, where)
    try:
        parse_keep_best(cfg.ckpt.keep_best, cfg.eval.every)
    except ConfigError as e:
        raise ConfigError(f"{where}{e}") from None
    if cfg.ckpt.resume not in ("none", "latest") and not Path(cfg.ckpt.resume).exists():
        raise ConfigError(f"{where}ckpt.resume={cfg.ckpt.resume!r}: no such checkpoint directory")
    if training:
        check_trainable_dtype(cfg)
        check_training_losses(cfg, where)
    check_async(cfg, where, training)
    t = cfg.train
    if training and t.pack_sequences and cfg.model.attn_implementation == "flash_attention_2" and t.pack_row_tokens:
        raise ConfigError(
            f"{where}train.pack_row_tokens={t.pack_row_tokens} with model.attn_implementation=flash_attention_2: "
            "flash-attention packs each micro-batch into one row (its varlen path reads the sequence boundaries "
            "only in a batch of one row); leave train.pack_row_tokens at 0"
        )
    if training and t.share_prompt and cfg.model.attn_implementation == "flash_attention_2":
        raise ConfigError(
            f"{where}train.share_prompt=true with model.attn_implementation=flash_attention_2: the shared rows need "
            "a custom attention mask, which flash-attention does not take; use sdpa, or leave train.share_prompt off"
        )
    if training and t.share_prompt and t.pack_sequences:
        raise ConfigError(
            f"{where}train.share_prompt=true with train.pack_sequences=true: a micro-batch runs as one layout; "
            "choose one (share_prompt runs each group as one row, which already pads little)"
        )
    if training and cfg.rollout.allocation == "per_prompt":
        check_per_prompt(cfg, where)
    if training and cfg.rollout.group_size_auto:
        check_group_size_auto(cfg, where)
    if training and cfg.rollout.dynamic_sampling and cfg.loss.kl_coef > 0:
        raise ConfigError(
            f"{where}rollout.dynamic_sampling=true with loss.kl_coef={cfg.loss.kl_coef}: a group whose rewards tie "
            "still has a KL gradient, which replacing it would silently remove; set one of them off"
        )
    if cfg.rollout.min_new_tokens > cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"{where}rollout.min_new_tokens={cfg.rollout.min_new_tokens} > rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}: no completion could end"
        )
    bad_url = [u for u in cfg.server.urls if not re.fullmatch(r"https?://[^/\s]+/?", u)]
    if bad_url:
        raise ConfigError(f"{where}server.urls: {bad_url[0]!r} is not a base URL like 'http://host:8000'")
    if training and cfg.run.dist_timeout_s <= cfg.sync.final_timeout_s:
        raise ConfigError(
            f"{where}run.dist_timeout_s={cfg.run.dist_timeout_s:g} <= sync.final_timeout_s="
            f"{cfg.sync.final_timeout_s:g}: the other ranks wait at the final barrier while rank 0 uploads, and "
            "their collective would time out first; raise run.dist_timeout_s"
        )
    bad_k = [k for k in cfg.eval.ks if not 1 <= k <= cfg.eval.num_samples]
    if bad_k:
        raise ConfigError(
            f"{where}eval.ks={cfg.eval.ks}: k={bad_k[0]} is outside 1..eval.num_samples={cfg.eval.num_samples} "
            "(pass@k and maj@k need n >= k samples per problem)"
        )
    check_sync_target(cfg.sync.remote, cfg.sync.bucket, cfg.sync.path, where)
    check_multiturn(cfg, where)


def check_training_losses(cfg: Config, where: str = "") -> None:
    if cfg.probe.advisor and not cfg.probe.enabled:
        raise ConfigError(f"{where}probe.advisor=true with probe.enabled=false: the advisor is a probe; enable both")
    if cfg.probe.advisor and cfg.model.gradient_checkpointing:
        raise ConfigError(
            f"{where}probe.advisor=true with model.gradient_checkpointing=true: the advisor reads the unit level's "
            "per-sequence capture, which a recompute would fire twice; set one of them off"
        )
    if cfg.train.drop_zero_adv_groups is True and cfg.loss.kl_coef > 0:
        raise ConfigError(
            f"{where}train.drop_zero_adv_groups=true with loss.kl_coef={cfg.loss.kl_coef}: a zero-advantage "
            "group still has a KL gradient, which dropping it would silently remove; set one of them off"
        )
    correction, _ = cfg.loss.correction_spec()
    if correction != "none" and cfg.rollout.top_p < 1:
        raise ConfigError(
            f"{where}loss.correction={correction} with rollout.top_p={cfg.rollout.top_p}: the sampler's "
            "log-probs come from the top-p renormalised distribution, so pi_train/pi_rollout would not be an "
            "importance ratio; set rollout.top_p=1 or loss.correction=none"
        )


def check_multiturn(cfg: Config, where: str = "") -> None:
    m = cfg.multiturn
    if m.max_tokens_per_turn > m.max_response_tokens:
        raise ConfigError(
            f"{where}multiturn.max_tokens_per_turn={m.max_tokens_per_turn} > multiturn.max_response_tokens="
            f"{m.max_response_tokens}: one turn could never use its cap"
        )
    if any(not s for s in m.stop):
        raise ConfigError(f"{where}multiturn.stop={m.stop}: an empty stop string would end every turn at once")


def check_async(cfg: Config, where: str = "", training: bool = True) -> None:
    """rollout.max_async_level > 0 only where the staleness is corrected (rl_training/rollout/async_queue.py);
    whether the backend can run ahead is its own rule (rollout/kinds.py)."""
    k = cfg.rollout.max_async_level
    if not training or k == 0:
        return
    head = f"{where}rollout.max_async_level={k}"
    if cfg.loss.correction_spec()[0] == "none":
        raise ConfigError(
            f"{head} with loss.correction=none: batches come from a policy up to {k} steps old, and only an "
            "off-policy correction accounts for that (decoupled PPO); set loss.tis_cap (e.g. 2.0) or loss.correction"
        )


def check_sync_target(remote: str, bucket: str, path: str, where: str = "") -> None:
    """The upload destination must be a plain remote name and plain path segments: nothing that rclone could
    read as inline credentials (':s3,secret_access_key=...:') or a shell could expand. Values are not echoed."""
    if remote and not _REMOTE_NAME.fullmatch(remote):
        raise ConfigError(
            f"{where}sync.remote must be the name of an rclone remote (letters, digits, '_', '-', '.'); "
            "configure the remote and its credentials with RCLONE_CONFIG_<NAME>_* environment variables"
        )
    for key, value in (("bucket", bucket), ("path", path)):
        if _UNSAFE_PATH_CHARS & set(value):
            raise ConfigError(f'{where}sync.{key} may not contain any of " $ ` \\ : , or a newline')


def check_trainable_dtype(cfg: Config) -> None:
    """The RL and SFT runners train without a GradScaler, so float16 gradients would underflow: refuse it
    (load_config with training=True; evals load with training=False and may run in float16)."""
    if cfg.model.dtype == "float16":
        raise ConfigError(
            "model.dtype=float16 cannot train: there is no fp16 gradient scaler (small gradients underflow "
            "to 0); use bfloat16 or float32"
        )


def check_per_prompt(cfg: Config, where: str = "") -> None:
    """rollout.allocation: per_prompt plans each step from its own first round (probes/allocation.py)."""
    r, head = cfg.rollout, f"{where}rollout.allocation=per_prompt"
    k_max = r.allocation_k_max or 2 * r.group_size
    clash = [
        (r.max_async_level > 0, "rollout.max_async_level > 0: the plan reads the step's first round, which a "
         "producer thread would sample ahead"),
        (r.dynamic_sampling, "rollout.dynamic_sampling: both choose which groups a step trains on; pick one"),
        (r.allocation_first > k_max, f"rollout.allocation_first={r.allocation_first} over the k_max of {k_max}"),
        (k_max < 2, "rollout.allocation_k_max=1: a group needs 2 completions to teach anything"),
    ]  # fmt: skip
    for bad, why in clash:
        if bad:
            raise ConfigError(f"{head} with {why}")


def check_group_size_auto(cfg: Config, where: str = "") -> None:
    """rollout.group_size_auto follows the advisor's K* at checkpoint boundaries (probes/group_size.py)."""
    r, head = cfg.rollout, f"{where}rollout.group_size_auto=true"
    k_max = r.group_size_max or 2 * r.group_size
    clash = [
        (not (cfg.probe.enabled and cfg.probe.advisor), "probe.advisor off: the advisor's K* is what it follows"),
        (not cfg.ckpt.every, "ckpt.every=0: it switches at checkpoint boundaries, so that a resume trains the same"),
        (r.allocation == "per_prompt", "rollout.allocation=per_prompt: both choose the step's group sizes"),
        (r.max_async_level > 0, "rollout.max_async_level > 0: a producer thread would sample steps ahead of a switch"),
        (k_max < r.group_size_min, f"rollout.group_size_max={k_max} < rollout.group_size_min={r.group_size_min}"),
        (not r.group_size_min <= r.group_size <= k_max,
         f"rollout.group_size={r.group_size} outside [group_size_min, group_size_max] = [{r.group_size_min}, {k_max}]"),
    ]  # fmt: skip
    for bad, why in clash:
        if bad:
            raise ConfigError(f"{head} with {why}")
