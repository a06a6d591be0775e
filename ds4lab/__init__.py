"""ds4lab: the DeepSeek V4 Flash architecture, step by step, in a notebook."""
