"""The trainer app: `jshard train` and `jshard generate` as library calls, on the sharding core.

    from jshard.app.train_config import TrainConfig
    from jshard.app.training import train
    result = train(TrainConfig.of(model="tiny", strategy="dp+tp", steps=50, precision="bf16"))

Nothing in the core (`jshard`, `jshard.nn`, `jshard.parallel`, ...) imports it. The modules, by
what they do: `train_config.py` (the run's inputs in sections, and their checks), `prepare.py`
(everything checked and resolved before device work), `startup.py` (devices, shared with
generation), `training.py` (the loop), `components.py` (what the loop asks: evaluator,
checkpointer, profiler, metrics, the non-finite guard), `report.py` (set-up lines and summary),
`generation.py`, `data.py`, `documents.py`, `tokenizer.py`, `optim.py`, `checkpoint.py`, `hf.py`
(Hugging Face checkpoints in and out), `curves.py` (the run's curves), `config.py` (a named model
size with its overrides).
"""
