"""The HTTP server below the app (service/api/): uvicorn run with the bounded protocol, the connection caps, the
bounded logs and the stop sequence; imported by the command line only."""
