"""Post-training domains: the trajectory record and its checks (records.py), effort think budgets (budget.py),
the `general` domain's generated problems and reference traces (general.py), the `agent` and `coding` domains'
scripted experts acting in real sandboxes (agentic.py, traces.py; their task families are in
`openk3.agent.tasks`), and the pipeline's tokenizer trained on rendered conversations (vocab.py)."""
