"""trainlift: fine-tune on a laptop, then on a multi-node GPU cluster with the same spec."""

__version__ = "0.1.0"
