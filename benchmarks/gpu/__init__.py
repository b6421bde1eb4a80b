"""The GPU benchmark: fxpipe's runtime on one CUDA device, in guarded sections."""
