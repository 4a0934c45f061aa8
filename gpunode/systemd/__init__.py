"""systemd: the device plugin's unit (rendered from templates/), its install, and sd_notify."""
