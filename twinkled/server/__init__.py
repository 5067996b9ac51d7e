"""The daemon's faces to people: the HTTP app, the CLI and ctl, the admin API, logs."""
