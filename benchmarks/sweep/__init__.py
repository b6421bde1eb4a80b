"""The model sweep: about 300 real models (transformers, timm, torchvision) through fxpipe,
each checked against eager, one check per column of its table."""
