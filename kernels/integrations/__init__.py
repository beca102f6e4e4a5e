"""Adapters that plug the loss kernels into other training frameworks.

Each submodule imports its framework at import time and is imported only by a user who has it
installed (``kernels.integrations.tunix`` needs ``pip install "grpo-kernels[tunix]"``); nothing in
``kernels`` imports this package.
"""
