"""End-to-end check of MLA_QUANT in a real vLLM 0.33 engine on CUDA GPUs.

Builds a tiny DeepSeek-V2-style model locally: a config and a real safetensors
checkpoint of seeded weights at a realistic scale (every full tensor drawn from a
generator seeded by its name, so the weights do not depend on the tensor-parallel
size: vLLM's own weight loaders shard them), token ids instead of a tokenizer.
Then it runs ``vllm.LLM`` in one subprocess per configuration (its own log,
result JSON and timeout; a failure does not stop the others):

- TRITON_MLA and MLA_QUANT with no quantization, eager and with CUDA graphs:
  prompt logprobs (prefill, including a chunked-context prefill) and greedy
  generation logprobs (decode) must agree within ``--tol`` (default 0.05 nats).
  Greedy tokens must be identical, except that a divergence at a near tie (the
  native top-2 margin within ``2 * tol``) is reported, not failed; generated
  logprobs are compared up to the first divergence;
- MLA_QUANT with nvfp4 (decoding on read and through the write-once shadow) and
  fp8 recipes, eager and with CUDA graphs: nvfp4 through the shadow must match
  nvfp4 on read within ``--tol``; every quantized run must stay within bounds of
  its logprob differences against TRITON_MLA, and the eager ones of their
  per-layer error statistics, set at 3x (logprobs) and 1.5x (statistics) the run
  recorded in ``tests-vllm-e2e/results/`` (``bounds`` says how);
- calibration (``mla_vllm.calibrate``) and an nvfp4 run with the calibration file
  (bounded the same way);
- in-place ``install``/``uninstall`` on a TRITON_MLA engine: uninstall restores
  the native logprobs exactly.

``--tp N`` runs the engines at ``tensor_parallel_size=N`` (vLLM's multiprocess
executor: one worker process per GPU, started with ``spawn``, so MLA_QUANT must
be registered there through its ``vllm.general_plugins`` entry point: install the
packages' wheels, see docs/contributing.md). With N > 1 the default set is the
six TRITON_MLA / none / nvfp4 runs (eager and graphs) plus three configurations
that must fail in the workers with an error that reaches this process naming the
layer or the field. Each result records what every worker process saw (its pid,
rank, local heads, registration, the ``mla_quant`` config and each layer's
resolved recipe). ``--compare-tp A,B`` compares two result folders (say TP=1 and
TP=2): logprobs, per-layer statistics and recipes, within stated bounds; it needs
no GPU and writes ``tp_compare.txt`` / ``tp_compare.json`` into ``--out``.

``--out DIR`` receives ``<config>.log`` and ``<config>.json`` for every
configuration, ``calibration.json``, ``results.json`` (every run and check) and
``summary.txt`` (the table printed at the end). ``--jobs N`` runs N lanes of
configurations at once (each engine takes a fixed 1 GiB KV cache, so their memory
profiling cannot disturb each other; at TP=1 with several GPUs visible, lane i
runs on GPU i mod count); ``--deadline S`` stops starting configurations (and
cuts timeouts) so that everything ends within S seconds. Exit code 0 when every
check holds; 1 when a run or check fails; 2 when no CUDA GPU (or fewer than
``--tp``), no vLLM 0.33.0, or (TP > 1) no installed entry point is there.

Usage: ``python tests-vllm-e2e/run_e2e.py [--out DIR] [--tol 0.05] [--jobs 3]
[--deadline 400] [--tp 1] [--only NAME ...]``, or ``--compare-tp A,B``. Engines
run in this script's child process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's
in-process engine core, whose executor starts the TP workers), which also
registers ``MLA_QUANT`` itself; at TP=1 that is enough (no worker processes).

Modules: ``configs`` (the model, the configurations, their lanes), ``checkpoint``
(the seeded safetensors checkpoint), ``probes`` (what the engine and its workers
ran, registration), ``engine`` (one configuration in one engine: the child
process), ``schedule`` (child processes in lanes, timeouts, the deadline),
``checks`` (every check of a TP=N run), ``bounds`` (the quantized runs' bounds,
derived from ``tests-vllm-e2e/results/``), ``tp`` (``--compare-tp``) and ``cli``
(the command line). ``tests-vllm-e2e/run_e2e.py`` is the entry point.
"""
