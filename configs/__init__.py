"""Gin files shipped with terra (package data): models, sizes, tasks, runs and experiments.

Each folder is a package only so that gin can find its files as package resources
(``include 'terra/configs/models/dense_800m.gin'``) from any working directory.
"""
