"""`captioner serve`: captions over HTTP for programs. The command and its flags (``cli.py``), what
a request asks and how it is captioned, with the shared batcher and no web framework
(``service.py``), and the FastAPI application around it (``http.py``, imported only to serve)."""
