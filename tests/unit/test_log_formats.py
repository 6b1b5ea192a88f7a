"""Each log format ``freescale prepare`` reads, parsed from a tiny file into DuckDB's events
table, and the one-line errors of bad input; the MovieLens side-feature files."""

import gzip
import json

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from freescale.data.errors import DataError
from freescale.data.log_formats import EVENTS, LogOptions, check_options, expand_inputs, load_events
from freescale.data.side_features import AGE_EDGES, read_items, read_users

KUAIRAND_HEADER = ("user_id,video_id,date,hourmin,time_ms,is_click,is_like,is_follow,is_comment,is_forward,is_hate,"
                   "long_view,play_time_ms,duration_ms,profile_stay_time,comment_stay_time,is_profile_enter,is_rand,tab")


def events(fmt, paths, options=LogOptions()):
    """(user, item, rating, time) of every event, in file order."""
    con = duckdb.connect()
    check_options(fmt, options)
    load_events(con, fmt, expand_inputs([str(p) for p in paths]), options)
    return con.execute(f"SELECT CAST(user_key AS VARCHAR), CAST(item_key AS VARCHAR), rating, ts FROM {EVENTS} "
                       f"ORDER BY rowid").fetchall()


def write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("name, text", [
    ("u.data", "196\t242\t3\t881250949\n186\t302\t3.5\t891717742\n"),
    ("ml-100k.inter", "user_id:token\titem_id:token\trating:float\ttimestamp:float\n196\t242\t3\t881250949\n"
                      "186\t302\t3.5\t891717742\n"),
])
def test_ml100k(tmp_path, name, text):
    assert events("ml100k", [write(tmp_path / name, text)]) == [("196", "242", 3.0, 881250949.0),
                                                                 ("186", "302", 3.5, 891717742.0)]


def test_ml1m_ratings_dat(tmp_path):
    path = write(tmp_path / "ratings.dat", "1::1193::5::978300760\n1::661::3::978302109\n")
    assert events("ml1m", [path]) == [("1", "1193", 5.0, 978300760.0), ("1", "661", 3.0, 978302109.0)]


def test_ml20m_ratings_csv(tmp_path):
    path = write(tmp_path / "ratings.csv", "userId,movieId,rating,timestamp\n1,296,5.0,1147880044\n1,306,3.5,1147868817\n")
    assert events("ml20m", [path]) == [("1", "296", 5.0, 1147880044.0), ("1", "306", 3.5, 1147868817.0)]


def test_recbole_columns_in_any_order_and_no_rating(tmp_path):
    path = write(tmp_path / "x.inter", "item_id:token\ttimestamp:float\tuser_id:token\nA\t10.5\tu1\nB\t11\tu2\n")
    assert events("recbole", [path]) == [("u1", "A", 1.0, 10.5), ("u2", "B", 1.0, 11.0)]


@pytest.mark.parametrize("header", ["user,item,rating,timestamp\n", ""])
def test_csv_with_or_without_header(tmp_path, header):
    path = write(tmp_path / "log.csv", header + " u10, i1 ,4,1.5\nu9,i2,2,2.5\n")  # ids are stripped
    assert events("csv", [path]) == [("u10", "i1", 4.0, 1.5), ("u9", "i2", 2.0, 2.5)]


def test_csv_with_named_columns(tmp_path):
    path = write(tmp_path / "log.csv", "when;stars;uid;iid;other\n7;5;a;x;zz\n8;1;b;y;zz\n")
    options = LogOptions(columns={"user": "uid", "item": "iid", "time": "when", "rating": "stars"})
    assert events("csv", [path], options) == [("a", "x", 5.0, 7.0), ("b", "y", 1.0, 8.0)]


def test_amazon_ratings_only_csv(tmp_path):
    path = write(tmp_path / "ratings_Books.csv", "0001713353,A1C6M8LCIX4M6M,5.0,1123804800\n")
    assert events("amazon", [path]) == [("A1C6M8LCIX4M6M", "0001713353", 5.0, 1123804800.0)]


def test_amazon_2014_json_lines_gzipped(tmp_path):
    path = tmp_path / "reviews_Books_5.json.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"reviewerID": "A2", "asin": "000100039X", "reviewerName": "x", "overall": 4.0,
                            "reviewText": "a, b\tc", "unixReviewTime": 1203984000}) + "\n")
        f.write(json.dumps({"reviewerID": "A3", "asin": "000100039Y", "overall": 1.0, "unixReviewTime": 1203984001}) + "\n")
    assert events("amazon", [path]) == [("A2", "000100039X", 4.0, 1203984000.0), ("A3", "000100039Y", 1.0, 1203984001.0)]


def test_amazon_2023_json_lines_in_milliseconds(tmp_path):
    line = {"rating": 5.0, "title": "t", "text": "x", "asin": "B0C1", "parent_asin": "B0P", "user_id": "AGK",
            "timestamp": 1588687728923, "helpful_vote": 2, "verified_purchase": True}
    path = write(tmp_path / "Books.jsonl", json.dumps(line) + "\n")
    assert events("amazon", [path]) == [("AGK", "B0P", 5.0, 1588687728.923)]


def test_kuairand_files_in_name_order_with_signals_as_bits(tmp_path):
    write(tmp_path / "log_standard_4_22_to_5_08_1k.csv", KUAIRAND_HEADER + "\n7,20,20220422,1000,1650600000500,0,0,0,0,0,0,1,1,1,1,1,0,0,1\n")
    write(tmp_path / "log_standard_4_08_to_4_21_1k.csv", KUAIRAND_HEADER + "\n7,10,20220408,1000,1649400000000,1,1,0,0,0,0,1,1,1,1,1,0,0,1\n"
                                                                            "8,11,20220408,1000,1649400001000,1,0,0,0,0,0,0,1,1,1,1,0,0,1\n")
    got = events("kuairand", [tmp_path / "log_standard_*.csv"])
    # rating = is_click + 2 long_view + 4 is_like (the default labels, in order)
    assert got == [("7", "10", 7.0, 1649400000.0), ("8", "11", 1.0, 1649400001.0), ("7", "20", 2.0, 1650600000.5)]
    only_likes = events("kuairand", [tmp_path / "log_standard_*.csv"], LogOptions(signals=("is_like",)))
    assert [r[2] for r in only_likes] == [1.0, 0.0, 0.0]


def test_events_csv_in_milliseconds(tmp_path):
    path = write(tmp_path / "e.csv", "ts_ms,uid,vid\n1500,a,x\n2500,b,y\n")
    options = LogOptions(columns={"user": "uid", "item": "vid", "time": "ts_ms"}, time_unit="ms")
    assert events("events", [path], options) == [("a", "x", 1.0, 1.5), ("b", "y", 1.0, 2.5)]


def test_events_parquet_glob_with_timestamps_and_integer_ids(tmp_path):
    import datetime as dt

    for k in range(3):
        table = pa.table({"uid": pa.array([k, k + 10], pa.int64()), "iid": pa.array([5, 6], pa.int32()),
                          "at": pa.array([dt.datetime(2020, 1, 1, 0, 0, k), dt.datetime(2020, 1, 1, 0, 0, k, 500000)],
                                         pa.timestamp("us")),
                          "stars": pa.array([1.5, 2.0], pa.float32())})
        pq.write_table(table, tmp_path / f"part-{k}.parquet")
    options = LogOptions(columns={"user": "uid", "item": "iid", "time": "at", "rating": "stars"})
    got = events("events", [tmp_path / "part-*.parquet"], options)
    t0 = 1577836800.0
    assert got == [(str(u), str(i), r, t0 + s) for k in range(3)
                   for u, i, r, s in ((k, 5, 1.5, k), (k + 10, 6, 2.0, k + 0.5))]


def test_integer_ids_stay_integers_until_a_file_has_text_ids(tmp_path):
    pq.write_table(pa.table({"u": pa.array([10, 9]), "i": pa.array([1, 2], pa.int16()), "t": [1.0, 2.0]}),
                   tmp_path / "a.parquet")
    roles = LogOptions(columns={"user": "u", "item": "i", "time": "t"})
    con = duckdb.connect()
    load_events(con, "events", [str(tmp_path / "a.parquet")], roles)
    assert [r[1] for r in con.execute(f"DESCRIBE {EVENTS}").fetchall()][:2] == ["BIGINT", "BIGINT"]
    pq.write_table(pa.table({"u": ["x"], "i": pa.array([3], pa.int16()), "t": [3.0]}), tmp_path / "b.parquet")
    assert events("events", [tmp_path / "a.parquet", tmp_path / "b.parquet"], roles) == [
        ("10", "1", 1.0, 1.0), ("9", "2", 1.0, 2.0), ("x", "3", 1.0, 3.0)]


# --- bad input: one line naming the file (and line, column) ---------------------------------

@pytest.mark.parametrize("fmt, name, text, options, fragment", [
    ("csv", "log.csv", "", LogOptions(), "log.csv: no events"),
    ("csv", "log.csv", "user,item,rating,timestamp\n", LogOptions(), "log.csv: no events"),
    ("csv", "log.csv", "a,b,1\n", LogOptions(), "log.csv:1: expected 4 fields"),
    ("csv", "log.csv", "a,b,1,2\nc,d,1\n", LogOptions(), "log.csv:2: Expected Number of Columns: 4 Found: 3"),
    ("csv", "log.csv", "a,b,1,2\nc,d,1,2,3\n", LogOptions(), "log.csv:2: Expected Number of Columns: 4 Found: 5"),
    ("csv", "log.csv", "a,b,1,2\nc,d,high,2\n", LogOptions(), "log.csv:2: column rating: Could not convert string \"high\""),
    ("csv", "log.csv", "a,b,1,2\n,d,1,3\n", LogOptions(), "log.csv: event 2 (counting from 1 in the file) has no user id"),
    ("csv", "log.csv", "a,b,1,2\nc, ,1,3\n", LogOptions(), "event 2 (counting from 1 in the file) has no item id"),
    ("csv", "log.csv", "a,b,1,nan\n", LogOptions(), "event 1 (counting from 1 in the file) has a time that is not a finite"),
    ("ml20m", "ratings.csv", "userId,itemId,rating,timestamp\n1,2,3,4\n", LogOptions(), "ratings.csv: no column 'movieId'"),
    ("csv", "log.csv", "u;i;t\n1;2;3\n", LogOptions(columns={"user": "u", "item": "i", "time": "time"}),
     "log.csv: no column 'time' in the header (columns: u, i, t)"),
    ("kuairand", "log.csv", "user_id,video_id,time_ms\n1,2,3\n", LogOptions(), "log.csv: no column 'is_click'"),
    ("amazon", "r.json", '{"reviewerID": "a", "asin": "b", "overall": "five", "unixReviewTime": 3}\n', LogOptions(),
     "r.json: column overall: five is not a number"),
    ("amazon", "r.json", '{"reviewerID": "a", "overall": 5, "unixReviewTime": 3}\n', LogOptions(), "has no item id"),
    ("amazon", "r.json", '{"user": "a"}\n', LogOptions(), "r.json:1: expected Amazon review fields"),
])
def test_bad_input_raises_one_line_naming_the_file(tmp_path, fmt, name, text, options, fragment):
    path = write(tmp_path / name, text)
    with pytest.raises(DataError) as e:
        events(fmt, [path], options)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert str(path) in str(e.value)


def test_bad_parquet_columns(tmp_path):
    pq.write_table(pa.table({"u": [1], "i": [2], "t": ["yesterday"]}), tmp_path / "e.parquet")
    roles = {"user": "u", "item": "i", "time": "t"}
    with pytest.raises(DataError, match=r"e.parquet: column t \(VARCHAR\): expected a number or a timestamp"):
        events("events", [tmp_path / "e.parquet"], LogOptions(columns=roles))
    with pytest.raises(DataError, match=r"e.parquet: no column 'x' \(columns: u, i, t\)"):
        events("events", [tmp_path / "e.parquet"], LogOptions(columns={**roles, "rating": "x"}))
    write(tmp_path / "bad.parquet", "not parquet")
    with pytest.raises(DataError, match="bad.parquet: not a readable Parquet file"):
        events("events", [tmp_path / "bad.parquet"], LogOptions(columns=roles))


def test_missing_inputs_and_misfit_options(tmp_path):
    with pytest.raises(DataError, match="events file not found: .*nope.csv"):
        expand_inputs([str(tmp_path / "nope.csv")])
    with pytest.raises(DataError, match="no files match .*log_standard_"):
        expand_inputs([str(tmp_path / "log_standard_*.csv")])
    with pytest.raises(DataError, match="--columns: format events needs time=COLUMN"):
        check_options("events", LogOptions(columns={"user": "u", "item": "i"}))
    with pytest.raises(DataError, match="--columns: unknown role 'when'"):
        check_options("csv", LogOptions(columns={"when": "t"}))
    with pytest.raises(DataError, match="--columns: only for --format csv or events"):
        check_options("ml1m", LogOptions(columns={"user": "u"}))
    with pytest.raises(DataError, match="--labels: only for --format kuairand"):
        check_options("csv", LogOptions(signals=("is_click",)))
    with pytest.raises(DataError, match="--labels: expected KuaiRand columns"):
        check_options("kuairand", LogOptions(signals=("clicked",)))


# --- side features --------------------------------------------------------------------------

def test_the_three_user_files_give_the_same_features(tmp_path):
    u_user = read_users(str(write(tmp_path / "u.user", "1|24|M|technician|85711\n2|53|F|other|94043\n3|17|M|writer|32067\n")))
    recbole = read_users(str(write(tmp_path / "ml-100k.user", "user_id:token\tage:token\tgender:token\toccupation:token\t"
                                   "zip_code:token\n1\t24\tM\ttechnician\t85711\n2\t53\tF\tother\t94043\n3\t17\tM\twriter\t32067\n")))
    # users.dat holds age groups (1: under 18, 18, 25, ..., 56) and occupation codes.
    dat = read_users(str(write(tmp_path / "users.dat", "1::M::18::19::85711\n2::F::50::1::94043\n3::M::1::20::32067\n")))
    for table in (u_user, recbole, dat):
        assert table.keys == ["1", "2", "3"]
        assert table.values["age"] == [[1], [5], [0]]
        assert table.values["gender"] == [[1], [0], [1]]
        assert [(f.name, f.num_values, f.max_values) for f in table.features] == [
            ("age", len(AGE_EDGES) + 1, 1), ("gender", 2, 1), ("occupation", 3, 1)]
    assert u_user.values["occupation"] == [[1], [0], [2]]  # other < technician < writer


def test_the_three_item_files_give_the_same_features(tmp_path):
    flags = ["0"] * 19
    toy, heat = list(flags), list(flags)
    toy[3] = toy[4] = toy[5] = "1"  # Animation, Children's, Comedy
    heat[1] = "1"  # Action
    u_item = read_items(str(write(tmp_path / "u.item", f"1|Toy Story (1995)|01-Jan-1995||http://x|{'|'.join(toy)}\n"
                                  f"2|Heat (1995)|||http://y|{'|'.join(heat)}\n")))
    recbole = read_items(str(write(tmp_path / "ml-100k.item", "item_id:token\tmovie_title:token_seq\trelease_year:token\t"
                                   "class:token_seq\n1\tToy Story\t1995\tAnimation Children's Comedy\n2\tHeat\tunkonwn\tAction\n")))
    dat = read_items(str(write(tmp_path / "movies.dat", "1::Toy Story (1995)::Animation|Children's|Comedy\n2::Heat::Action\n")))
    for table in (u_item, recbole, dat):
        assert table.keys == ["1", "2"]
        assert table.values["genre"] == [[1, 2, 3], [0]]  # Action < Animation < Children's < Comedy
        assert table.values["year"] == [[9], []]  # 1995-99 (bucket 9 of YEAR_EDGES); unknown
        assert [(f.name, f.num_values, f.max_values) for f in table.features] == [("genre", 4, 3), ("year", 15, 1)]


def test_bad_side_files(tmp_path):
    with pytest.raises(DataError, match="side-feature file not found"):
        read_users(str(tmp_path / "u.user"))
    with pytest.raises(DataError, match=r"u.user:2: expected 5 fields separated by '\|', got 4"):
        read_users(str(write(tmp_path / "u.user", "1|24|M|technician|85711\n2|53|F|other\n")))
    with pytest.raises(DataError, match="u.user: age must be a number, got 'old'"):
        read_users(str(write(tmp_path / "u.user", "1|old|M|technician|85711\n")))
    with pytest.raises(DataError, match="u.user: id '1' appears twice"):
        read_users(str(write(tmp_path / "u.user", "1|2|M|a|1\n1|3|F|b|2\n")))
