import os

# bm's Triton kernels run in Triton's interpreter in the tests (on CPU tensors). triton.jit fixes that
# choice when torch imports triton, so it is made here, before any test module imports torch.
os.environ.setdefault("TRITON_INTERPRET", "1")
