"""LightningCLI: any LightningModule/DataModule, quantized by adding the callback on the command line or in YAML.

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    python examples/lightning_cli.py fit --model lq.zoo.SmallCNN --data lq.zoo.DigitsDataModule \\
        --trainer.max_epochs 10 --trainer.callbacks+=lq.QuantCallback --trainer.callbacks.calib.method=percentile

(`lq-cli` is the same entry point, installed with the package.)
"""

from lq.cli import lightning_cli

if __name__ == "__main__":
    lightning_cli()
