"""Checkpoints, in one place:

- `hugging_face`: a model as transformers reads and writes it (`config.json`, `model.safetensors`): `--save`,
  `--init`, `checkpoint export`, and the comparisons with transformers' own models.
- `sharded`: the training checkpoint (`--checkpoint-dir`, `--resume`): every rank writes the pieces it owns of the
  model, the optimizer state, the data position and the scaler, then rank 0 publishes a manifest; a checkpoint
  loads on any mesh (resharding on load).
- `upkeep`: looking after training checkpoints: verifying one (sizes and SHA-256), keeping the newest N, the whole
  model of one for export.

Errors a checkpoint causes are `errors.ConfigError`s (`errors.CorruptCheckpoint` for damaged files), agreed
across ranks with `errors.on_every_rank`.
"""
