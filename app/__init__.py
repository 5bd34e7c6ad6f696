"""The web app: a Streamlit page over the captioner library (UI only)."""
