"""Session setup that must happen before any test module imports triton."""

import os

import torch

if not torch.cuda.is_available():
    # No GPU: the Triton kernels run on CPU tensors in Triton's interpreter. Triton fixes the mode
    # when it is first imported (transformers imports it), so set it before collection starts.
    os.environ.setdefault("TRITON_INTERPRET", "1")
