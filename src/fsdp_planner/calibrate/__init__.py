"""Calibration: the cluster's figures fitted from measurements. ``nccl_logs`` (collectives from nccl-tests logs),
``overhead`` (FSDP2's host cost on the fake process group, ``calibrate --overhead``), ``gloo`` and ``worker`` (a
cluster of this machine's CPU ranks measured in a torchrun job, ``calibrate --backend gloo``). It runs jobs with
``runtime``; nothing below it imports it."""
