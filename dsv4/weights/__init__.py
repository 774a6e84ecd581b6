"""Checkpoint I/O: tensor names (``names``), quantized formats (``quant``), loading
(``loader.load_model``) and random checkpoints (``saver.save_random_checkpoint``)."""
