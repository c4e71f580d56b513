"""``make gpu-check``'s parts: model shapes, checkpoint writer, server and HF drivers, report."""
