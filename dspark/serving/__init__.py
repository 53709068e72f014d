"""vLLM in the loop: the worker run by vLLM's own interpreter (vllm_worker.py, vllm_load_audit.py: vLLM + stdlib
only), the project-side client (engine.py), the load-audit verdict (audit.py) and the eval.py-vs-vLLM
comparison (parity.py). Nothing here imports vLLM into the project's interpreter."""
