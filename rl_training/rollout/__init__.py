"""Generation: the backend protocol and its implementations (colocated vLLM, HF, vLLM servers), the generic
multi-turn episode engine, the async queue. May import: base, config, data, policy, ckpt, tasks. Owns: every
call into vLLM (vllm_engine.py, server*.py) and the Rollouts a step learns from."""
