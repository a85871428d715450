"""Unified communicator over NCCL / RCCL / HCCL / XCCL / Gloo with cross-vendor relay (needs torch)."""
