"""Quantized linear weights: their formats, the reference math and the methods that apply them."""
