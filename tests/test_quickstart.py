"""`make run`'s main job runs end to end on the tiny config."""

from terra import quickstart


def test_quickstart_generates_and_reports_decode_latency(capsys):
    assert quickstart.main(["--batch_size", "2", "--max_decode_length", "6"]) == 0
    out = capsys.readouterr().out
    assert "greedy generation (2 rows" in out and "temperature 0.5 generation" in out
    assert "per token, median" in out and "ms" in out
