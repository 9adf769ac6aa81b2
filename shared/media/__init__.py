"""What both the api and the encoding farm need to read a video: the content check, the probe, the farm's messages."""
