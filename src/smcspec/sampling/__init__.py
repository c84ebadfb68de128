"""Pure tensor-in/tensor-out sampling, weighting and resampling functions."""
