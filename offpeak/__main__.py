from offpeak.cli import app

app()
