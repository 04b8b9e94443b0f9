"""The job file the benchmarks submit: one model and training recipe (2 layers, dropout 0.5, lr 0.01,
weight decay 5e-4) on a generated graph, in any parallelism mode."""


def job_yaml(name, graph, a, mode, workers, out_dir, seed=0, eval_every=1, cache_rows=None):
    """`a` carries kind, hidden, epochs, and for mini-batch modes fanouts and batch."""
    text = f"""name: {name}
dataset:
  path: {graph}
model:
  kind: {a.kind}
  layers: 2
  hidden: {a.hidden}
  dropout: 0.5
  input_dropout: 0.0
train:
  epochs: {a.epochs}
  lr: 0.01
  weight_decay: 0.0005
  seed: {seed}
  eval_every: {eval_every}
workers: {workers}
parallelism: {mode}
output:
  dir: {out_dir}/jobs
"""
    if mode != "partition":
        text += f"minibatch:\n  fanouts: [{a.fanouts}]\n  batch_size: {a.batch}\n"
        if cache_rows is not None:
            text += f"  cache_rows: {cache_rows}\n"
    return text
