"""``python -m mla_vllm.compare``: the ``mla-compare`` command."""

from mla_vllm.compare.cli import main

raise SystemExit(main())
