"""The foundations every layer uses: errors, atomic writes, progress, device and process group, compatibility shims, artifact metadata and provenance, flag validation and the YOLOv9 adapter."""
