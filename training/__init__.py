"""Training-side helpers: the real labelled datasets (``datasets``) and the registry packages they ship in (``sources``)."""
