"""CPU check: the e2e checkpoint loads through vLLM 0.33 and shards by construction.

Writes the e2e's seeded safetensors checkpoint, then builds the real
``DeepseekV2ForCausalLM`` with vLLM's own loader (``load_format="safetensors"``,
attention backend ``MLA_QUANT``) on vLLM's CPU platform, once at tensor-parallel
size 1 and once at size 2 (two processes over gloo). Checks that every parameter
of every rank is exactly its shard of the same full seeded tensor: column-parallel
``q_proj``/``kv_b_proj`` and the merged ``gate_up_proj`` by output rows (heads),
row-parallel ``o_proj``/``down_proj`` by input columns, vocabulary-parallel
``embed_tokens``/``lm_head`` by rows, the rest replicated; and that the absorbed
``W_UK_T``/``W_UV`` of the two ranks are the TP=1 ones split by heads.

Run: ``cd /work/main && .nox/vllm/bin/python tests-vllm-e2e/check_checkpoint.py``
(about a minute; no GPU). Exit code 0 when every check holds.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_rank(rank: int, tp: int, port: int, model_dir: str, out: str) -> None:
    """Build and load the model as rank ``rank`` of ``tp``; save its parameters."""
    import torch
    from vllm.config import (
        AttentionConfig,
        CacheConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.model_loader import get_model

    from mla_vllm.plugin import register

    register()
    config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024
        ),
        load_config=LoadConfig(load_format="safetensors"),
        cache_config=CacheConfig(block_size=16),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        attention_config=AttentionConfig(backend="MLA_QUANT"),  # type: ignore[arg-type]
    )
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=tp,
            rank=rank,
            local_rank=rank,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}",
        )
        initialize_model_parallel(tp, 1)
        model = get_model(vllm_config=config)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(params, Path(out) / f"tp{tp}_rank{rank}.pt")


def _spawned(rank: int, tp: int, port: int, model_dir: str, out: str) -> None:
    load_rank(rank, tp, port, model_dir, out)


def expected_shard(name: str, full: dict[str, Any], tp: int, rank: int) -> Any:
    """The shard of parameter ``name`` that vLLM's weight loaders give ``rank``."""
    import torch

    def rows(t: Any) -> Any:
        return t.chunk(tp, dim=0)[rank]

    if name.endswith("mlp.gate_up_proj.weight"):
        base = name.removesuffix("gate_up_proj.weight")
        return torch.cat(
            [rows(full[base + "gate_proj.weight"]), rows(full[base + "up_proj.weight"])]
        )
    tensor = full[name]
    if name.endswith(
        ("q_proj.weight", "kv_b_proj.weight", "embed_tokens.weight", "lm_head.weight")
    ):
        return rows(tensor)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return tensor.chunk(tp, dim=1)[rank]
    return tensor


def main() -> int:
    import torch
    import torch.multiprocessing as mp
    from mla_e2e.checkpoint import checkpoint_shapes, write_checkpoint
    from safetensors.torch import load_file

    work = Path(tempfile.mkdtemp(prefix="mla-ckpt-"))
    model_dir = work / "model"
    sha = write_checkpoint(model_dir)
    full = load_file(str(model_dir / "model.safetensors"))
    assert set(full) == set(checkpoint_shapes()), "checkpoint names"
    print(f"checkpoint: {len(full)} tensors, sha256 {sha[:12]}")
    for tp in (1, 2):
        mp.spawn(_spawned, args=(tp, _free_port(), str(model_dir), str(work)), nprocs=tp)
    problems: list[str] = []
    ranks = {(tp, r): torch.load(work / f"tp{tp}_rank{r}.pt") for tp in (1, 2) for r in range(tp)}
    checked = 0
    for (tp, rank), params in sorted(ranks.items()):
        for name, value in params.items():
            if ".mla_attn." in name:  # W_UK_T / W_UV: derived from kv_b_proj, below
                continue
            want = expected_shard(name, full, tp, rank)
            if value.shape != want.shape or not torch.equal(value, want):
                problems.append(f"TP={tp} rank {rank} {name}: not its shard of the full tensor")
            checked += 1
    one, two = ranks[(1, 0)], (ranks[(2, 0)], ranks[(2, 1)])
    for name, value in one.items():
        if ".mla_attn." in name:
            joined = torch.cat([two[0][name], two[1][name]], dim=0)  # heads first
            if not torch.equal(joined, value):
                problems.append(f"{name}: TP=2 ranks' heads do not join into TP=1's")
            checked += 1
    for line in problems:
        print("FAIL:", line)
    print(f"check_checkpoint: {checked} parameter shards checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
