"""Checkpoint I/O below the model: tensor names (``names``), quantized formats (``quant``,
``formats``, ``native``), reading a checkpoint into a model (``loader.fill_model``) and writing a
state dict as one (``saver.write_checkpoint``). ``dsv4.checkpoint`` builds the models."""
