"""GuessMyCity: cities and splits, the rules on hand-made games, the knowledge-base oracle."""
import json

import pytest

from envs.guess_my_city.cities import DATA_PATH, EXPECTED_COUNTS, SPLITS, load_cities, normalize


@pytest.fixture(scope="module")
def cities():
    return load_cities()


def test_splits_hold_each_real_city_once(cities):
    assert {s: len(cities.split(s)) for s in SPLITS} == EXPECTED_COUNTS
    # Disjoint as cities: no name (own or alias) is shared by two tasks of different splits.
    by_name = {}
    for c in cities.cities:
        for n in c.names:
            assert by_name.setdefault(normalize(n), c) is c, f"{n!r} names {c.id} and {by_name[normalize(n)].id}"
    test_countries = {c.country for c in cities.split("test")}
    assert test_countries == {"Canada", "Cuba", "Ethiopia"}
    assert not test_countries & {c.country for s in ("train", "val") for c in cities.split(s)}


def test_duplicate_entries_merge_into_the_split_that_teaches_them(cities):
    ids = {c.id for c in cities.cities}
    assert "Chennai, India" not in ids and "Bangalore, India" not in ids
    madras, bengaluru = cities.get("Madras, India"), cities.get("Bengaluru, India")
    assert madras.split == bengaluru.split == "train"
    assert cities.named("Chennai") is madras and cities.named("Bangalore") is bengaluru
    source = json.loads(DATA_PATH.read_text())["cities"]
    assert len(source) == len(cities.cities) + 2


def test_a_name_of_two_cities_is_an_alias_of_neither(cities):
    assert cities.named("Santiago").id == "Santiago, Chile"
    assert cities.named("Santiago, Cuba") is None
    assert cities.named("Santiago de Cuba").id == "Santiago de Cuba, Cuba"
    assert cities.named("Puerto") is None


def test_names_match_whole_after_normalisation(cities):
    assert cities.named("  sao-paulo ").id == "Sao Paulo, Brazil"
    assert cities.named("Timisoara").id == cities.named("Timișoara").id
    assert cities.named("Porto").id == "Porto Alegre, Brazil"
    assert cities.named("Portoviejo").id == "Portoviejo, Ecuador"
    assert cities.named("Porto Alegre, Brazil").id == "Porto Alegre, Brazil"
    assert cities.named("Porto Alegre, Chile") is None
    assert cities.named("Porto Alegr") is None
