"""Prefill balancer: length buckets, engine apportionment, rank choice and chunk planning."""
