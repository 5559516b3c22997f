"""mega"""
