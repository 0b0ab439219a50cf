"""Checkpoints: the store (save and load), the completion marker, the resume choice, the best-k record, the
background upload with rclone. May import: base, config. Owns: runs/<name>/checkpoints and their upload."""
