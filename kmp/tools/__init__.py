"""kmp's tools, built on `kmp.core` (which never imports them).

One package per tool, its `__init__` naming what it exports and its
modules; a part written per backend is named after it (`tensorflow.py`,
`jax.py`, `torch.py`) in its tool's package:

- `convert/`: `kmp.convert`, a model under another policy, same weights
  (`model`, `optimizer`, `keep_float32`, and `rebuild` with
  `config_policies` and `layer_pairs` for keras-hub style models);
- `audit/`: `kmp.audit`, ranges, underflow and error per layer on real
  data (`run`, `data`, `probe`, `gradients`, `stats`, `report`, `plot`;
  `backend` picks the gradients' per-backend part);
- `bench/`: `kmp bench`, policies timed and compared on one model (`run`,
  `models`, `plan`, `configuration`, `rounds`, `stats`, `report`; the
  steps per backend),
  with `timing`, the toolkit `benchmarks/` uses too;
- `monitor/`: `kmp.callbacks.LossScaleMonitor`, the loss scale in `fit`'s
  logs (`callback`; `output`: TensorBoard and CSV);
- modules: `summary` (each layer's dtypes and the mistakes visible in the
  structure), `doctor` (the machine and the policy that suits it),
  `testing` (fault injection, `kmp.testing`);
- shared by the tools: `models` (walking a model's graph), `tables` (text
  tables).

The command line is the separate package `kmp_cli`.
"""
