"""Measurement: the serving loop, AIPerf, test_ep parsing, statistics, answer agreement, published figures."""
