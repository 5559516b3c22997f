"""pallas_kernels"""
