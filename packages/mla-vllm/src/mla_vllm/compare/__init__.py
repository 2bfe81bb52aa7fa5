"""``mla-compare``: what a quantized attention recipe costs a model, against native MLA.

``mla-compare MODEL --prompts FILE --recipe nvfp4 --recipe fp8`` (also ``python -m
mla_vllm.compare``) serves the model natively and once per recipe, each engine in its
own process, teacher-forced on the same tokens, and reports per recipe the KL of the
next-token distributions (from top-k logprobs, ``metrics``), top-1 agreement,
perplexity and its change, greedy agreement and the per-layer attention error of
``observe``. With ``--generate N`` each recipe's engine also generates N tokens per
prompt and the native engine scores them (``generation``: KL, top-1, ΔNLL and expected
acceptance per generated position, by position and context length, with bootstrap
intervals; ``--turns`` for several turns per prompt). Modules: ``metrics`` (the maths),
``generation`` (the generated positions' figures), ``tasks`` (task accuracy, answer
flips, McNemar; ``tasks_cli``: ``mla-compare tasks``), ``inputs`` (prompts, recipes
and their ``--calibration`` copies), ``launch`` (one process per engine), ``engine``
(that process: vLLM), ``report`` (JSON, tables, PNGs), ``cli``. Everything but
``engine.run_spec`` runs without a GPU.
"""

from __future__ import annotations

from mla_vllm.compare.cli import main, run
from mla_vllm.compare.metrics import TopK, kl_topk, perplexity, summarize

__all__ = ["TopK", "kl_topk", "main", "perplexity", "run", "summarize"]
