"""Command-line entry points: ``lq-train`` (Hydra app) and ``lq-cli`` (LightningCLI with the callbacks)."""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from lq.config import register_configs

register_configs()


@hydra.main(version_base=None, config_path="pkg://lq.conf", config_name="train")
def _train(cfg: DictConfig) -> None:
    from lq.pipeline import run_job

    job = OmegaConf.to_object(cfg)  # builds the dataclasses: bad values fail here, naming the field
    run_job(job)


def train() -> None:
    """``lq-train [hydra overrides]``: the whole pipeline on the configured model and data.

    The current directory is importable, as with ``python -m``, so ``model._target_=my_pkg.MyModule``
    finds a ``my_pkg.py`` next to where you run it.
    """
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    bad = unknown_override(sys.argv[1:])
    if bad:
        print(f"lq-train: {bad}", file=sys.stderr)
        sys.exit(2)
    _train()


def unknown_override(overrides) -> str:
    """A one-line message for the first ``key=value`` override that names no config field (with the closest
    field), or ``""``. Hydra's own message only suggests appending the typo with ``+``."""
    import difflib
    from dataclasses import fields

    from lq.config import JobConfig, QuantConfig, QuantizerConfig

    groups = {f.name: type(getattr(JobConfig(), f.name)) for f in fields(JobConfig)
              if f.name in ("quant", "calib", "qat", "export")}
    for arg in overrides:
        if "=" not in arg or arg[0] in "+~" or arg.startswith("hydra"):
            continue
        path = arg.split("=", 1)[0].split(".")
        cls = JobConfig
        if path[0] in groups and len(path) > 1:
            cls, path = groups[path[0]], path[1:]
            if issubclass(cls, QuantConfig) and path[0] in ("input", "weight") and len(path) > 1:
                cls, path = QuantizerConfig, path[1:]
        elif path[0] in ("model", "data", "trainer") or len(path) > 1:
            continue  # free-form arguments of the user's classes and of lightning.Trainer
        names = [f.name for f in fields(cls)]
        if path[0] not in names:
            close = difflib.get_close_matches(path[0], names, n=1)
            key = arg.split("=", 1)[0]
            hint = f"did you mean '{key[: len(key) - len(path[0])]}{close[0]}'? " if close else ""
            return f"'{key}' is not an option: {hint}({cls.__name__} has {', '.join(names)})"
    return ""


def lightning_cli(args=None) -> None:
    """``lq-cli fit --model ... --data ... --trainer.callbacks+=lq.QuantCallback``: plain LightningCLI.

    Any LightningModule/DataModule import path works for ``--model``/``--data``;
    the quantization callbacks are configured with their typed arguments,
    e.g. ``--trainer.callbacks.calib.method=entropy``.
    """
    import torch
    from lightning.pytorch.cli import LightningCLI

    torch.set_flush_denormal(True)
    try:
        LightningCLI(subclass_mode_model=True, subclass_mode_data=True, args=args,
                     save_config_kwargs={"overwrite": True})
    except Exception as e:  # noqa: BLE001 - only lq's own config errors are shortened, the rest re-raised
        cause = config_error(e)
        if cause is None:
            raise
        print(f"lq-cli: {cause}", file=sys.stderr)
        sys.exit(2)


def config_error(e: BaseException):
    """The message of an lq config error somewhere in ``e``'s chain (jsonargparse wraps it in a long
    traceback of its own), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if isinstance(e, ValueError) and tb is not None and tb.tb_frame.f_code.co_filename.endswith(
                os.path.join("lq", "config.py")):
            return str(e)
        e = e.__cause__ or e.__context__
    return None


if __name__ == "__main__":
    sys.exit(train())
