"""``python -m bench serve``: benchmark any OpenAI- or Anthropic-compatible deployment.

Modules: workloads.py (what is sent), arrivals.py (when), client.py (one timed streamed
request), loop.py (the load and its bounds), metrics.py (the figures), prom.py (the server's
Prometheus metrics), output.py (table, JSON, JSONL, SVG, HTML), cli.py (the command line).
"""
