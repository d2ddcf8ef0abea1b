"""Measurements: counters, rate-limited logging, snapshots and their exporters. Imports no SGLang."""
