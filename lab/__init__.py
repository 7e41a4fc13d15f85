"""Tiny-model research (not installed, not imported by nbcore or pipeline): the trainer of the
tiny checkpoints in models/, its probes and growth logs. Run its scripts from the repository root
(`python lab/train_backbone.py --help`); tests: `python -m pytest lab/tests`."""
