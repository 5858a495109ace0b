"""kmp's tools, built on `kmp.core` (which never imports them).

- `convert`: a model under another policy, same weights (`keep_float32`,
  `rebuild` for keras-hub style models);
- `summary`: each layer's dtypes and the mistakes visible in the structure;
- `audit`: ranges, underflow and error per layer on real data
  (`audit_data`, `audit_probe`, `audit_gradients`, `audit_stats`,
  `audit_report`, `audit_plot`), with `gradients`, the one part written per
  backend (`tf_gradients`, `jax_gradients`, `torch_gradients`);
- `doctor`: the machine and the policy that suits it;
- `bench`: policies timed and compared on one model, on every backend
  (`bench_models`, `bench_plan`, `bench_configuration`, `bench_rounds`,
  `bench_stats`, `bench_report`;
  the steps of each backend in `tf_bench`, `jax_bench`, `torch_bench`),
  with `timing`, the toolkit `benchmarks/` uses too;
- `monitor`: the loss scale in `fit`'s logs (`monitor_output`: TensorBoard
  and CSV); `testing`: fault injection;
- shared: `models` (walking a model's graph), `tables` (text tables).

The command line is the separate package `kmp_cli`.
"""
