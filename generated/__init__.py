"""Fused model files written by `fusegen build`. Do not edit them by hand."""
