"""Helpers the tests import (plain code, not fixtures):

- references: plain, slow reference implementations (Sinkhorn, HC and mHC layers) to hold
  the library to;
- op_cases: random inputs and comparisons for the op implementations;
- branches: small attention and MLP branches for connection tests;
- hf_cases: the tiny transformers configurations of the Hugging Face tests;
- cli: `mhc` run in the test process, and the check of its one-line errors;
- launch: torchrun launches of the multi-process workers;
- titan_support: shared pieces of the torchtitan tests and their worker.
"""
