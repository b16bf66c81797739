"""Training side: the real labelled datasets (``datasets``, ``sources``) and the default model's two-stage AdapterFusion
training (``train``, with its loop in ``loop``) and evaluation report (``report``)."""
