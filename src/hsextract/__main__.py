from hsextract.cli import run

run()
